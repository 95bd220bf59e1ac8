"""What to try and in what order: the search space and the Optuna study."""
