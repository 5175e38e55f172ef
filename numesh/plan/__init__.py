"""`numesh plan`: predict the memory and step time of every layout of a model on N ranks.

Pieces, one job each: `layout` (the model's sizes and one layout), `search` (every layout
`numesh train` accepts), `memory` and `timing` (the predictions, from `numesh.perf.formulas`
and the schedules' `simulate`), `hardware` and `costs` (profiles and cost models),
`calibrate` (measure this machine), `presets` (GPT-2/GPT-3 sizes), `render` (table, JSON),
`predict` (one layout's memory and time, and `plan` over all of them), `fits` (whether
`numesh train`'s run fits this machine's free memory, asked before it starts).
"""

from numesh.plan.layout import Layout, ModelSpec
from numesh.plan.predict import Prediction, plan, predict

__all__ = ["Layout", "ModelSpec", "Prediction", "plan", "predict"]
