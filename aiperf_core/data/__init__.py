"""Datasets. `digits` is the embedded real dataset that ships offline with scikit-learn."""
