"""``specpilot round``: the paper's procedure (section 3) as one library call.

re-measure (:mod:`.measure`) -> model (:mod:`.modeling`) -> propose (:mod:`.propose`) ->
approve (:mod:`.approve`) -> remember (:mod:`.remember`), orchestrated by :mod:`.run` and budgeted
by :mod:`.plan`; :mod:`.inputs` checks a new round's options, :mod:`.state` reads a round's folder
back, :mod:`.dry_run` is the plan without running; :mod:`.check` is the CI gate against a round's
baseline (:mod:`.baseline`); :mod:`.sglang` the SGLang deployment form.
"""

from .baseline import read_baseline
from .dry_run import plan_round
from .run import RoundConfig, run_round
from .state import RoundResult, load_round

__all__ = ["RoundConfig", "RoundResult", "load_round", "plan_round", "read_baseline", "run_round"]
