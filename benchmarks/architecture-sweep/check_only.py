"""check_causal_lm alone on configs whose tiny model could not run generate(): hybrids must be refused."""
import sys

sys.path.insert(0, "tests")
from conftest import tiny_any_config
from transformers import AutoConfig

from specdec.errors import SpecDecError
from specdec.models.loading import check_causal_lm

for t in sys.argv[1:]:
    for label, make in (("tiny", lambda t=t: tiny_any_config(t)), ("default", lambda t=t: AutoConfig.for_model(t))):
        try:
            cfg = make()
        except Exception as e:
            print(f"{t} [{label}]: no config ({type(e).__name__}: {str(e)[:80]})")
            continue
        try:
            cls = check_causal_lm(cfg, t)
            print(f"{t} [{label}]: ACCEPTED as {cls.__name__}")
        except SpecDecError as e:
            print(f"{t} [{label}]: refused: {str(e)[:170]}")
        except Exception as e:
            print(f"{t} [{label}]: CRASH {type(e).__name__}: {str(e)[:150]}")
