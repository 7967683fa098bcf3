"""The data path: which sample each step trains on, and (next) cleaning the corpus."""
