"""The pieces of the byte-level language-model experiment (``experiments/train_lm.py``)."""
