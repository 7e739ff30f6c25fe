"""Plain-torch references: the ground truth of every test, one module per op family."""
