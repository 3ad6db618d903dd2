"""The pipeline's steps as plain Python: config, schema, manifests, validation, tracking, evaluation, model store."""
