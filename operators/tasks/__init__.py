"""The pipeline's task operators, one module per task id users see: prepare_data, train,
validate_checkpoint, register_model and the close_run teardown (wired by trainforge.graph)."""
