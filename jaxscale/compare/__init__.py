"""`jaxscale compare`, the main job: every strategy on the same batches, measured next to
its prediction. `strategies` names, runs and judges them, `predict` predicts their bytes,
`run` drives the worker processes (`worker`), `abstract` compiles without running, and
`report`, `charts` and `time_model` present the rows."""
