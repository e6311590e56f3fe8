"""A simulated vLLM inference pod: OpenAI-compatible API, real tokenizer, GPU cost model.

Run it with ``python -m extproc.sim`` or start one in-process with ``build_app(SimOptions())``.
See ``extproc/sim/README.md`` for the cost model and where its defaults come from.
"""

from extproc.sim.options import SimOptions
from extproc.sim.server import SIM_POD, SimPod, build_app

__all__ = ["SIM_POD", "SimOptions", "SimPod", "build_app"]
