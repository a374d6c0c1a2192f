"""ru-pool: the shared pool of recyclable units (hot memory, warm Redis, cold S3) and its global index."""
