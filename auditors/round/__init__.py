"""``specpilot round``: the paper's procedure (section 3) as one library call.

re-measure (:mod:`.measure`) -> model (:mod:`.modeling`) -> propose (:mod:`.propose`) ->
approve (:mod:`.approve`) -> remember (:mod:`.remember`), orchestrated and budgeted by
:mod:`.run`; :mod:`.check` is the CI gate against a round's baseline; :mod:`.sglang` the SGLang
deployment form.
"""

from .run import RoundConfig, RoundResult, load_round, plan_round, read_baseline, run_round

__all__ = ["RoundConfig", "RoundResult", "load_round", "plan_round", "read_baseline", "run_round"]
