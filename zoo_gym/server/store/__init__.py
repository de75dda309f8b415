"""Storage: the state directory, database models and migrations, blobs, checkpoint writing."""
