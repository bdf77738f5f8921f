"""`specdec bench` with `PlainDecodingCheck.prior_tokens` set from $PRIOR (the A/B of the pooled factor).

PRIOR=0 python prior.py bench ...   # each batch bucket on its own (the rule before)
PRIOR=16 python prior.py bench ...  # the default
"""

import os
import sys
from typing import Any

from specdec.cli import main
from specdec.drafting import cast

PRIOR = float(os.environ["PRIOR"])
_init = cast.PlainDecodingCheck.__init__


def _init_with_prior(self: cast.PlainDecodingCheck, *args: Any, **kwargs: Any) -> None:
    kwargs.setdefault("prior_tokens", PRIOR)
    _init(self, *args, **kwargs)


cast.PlainDecodingCheck.__init__ = _init_with_prior  # type: ignore[method-assign]
sys.exit(main(sys.argv[1:]))
