"""`jaxscale compare`, the main job: every strategy on the same batches, measured next to
its prediction. `strategies` names and predicts them, `run` drives the workers, `report`,
`charts` and `time_model` present the rows."""
