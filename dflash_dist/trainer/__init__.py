"""The drafter trainer: DeepSpeed settings (ds_config), micro-batches (batching), TensorBoard
metrics (metrics) and the plain-Python training loop (loop). No Ray here: actors/ runs it."""
