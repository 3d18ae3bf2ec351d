"""What the user brings: model specs and loading (factories, Hugging Face folders, whole modules), trust,
calibrated checkpoints, and data of every kind (arrays, text, images)."""
