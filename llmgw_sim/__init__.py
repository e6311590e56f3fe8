"""A simulated vLLM inference pod: OpenAI-compatible API, real tokenizer, GPU cost model.

Run it with ``python -m llmgw_sim`` or start one in-process with ``build_app(SimOptions())``.
See ``llmgw_sim/README.md`` for the cost model and where its defaults come from.
"""

from llmgw_sim.options import SimOptions
from llmgw_sim.server import SIM_POD, SimPod, build_app

__all__ = ["SIM_POD", "SimOptions", "SimPod", "build_app"]
