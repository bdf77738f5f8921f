"""`specdec bench` with PlainDecodingCheck.prior_tokens from $PRIOR (A/B of the pooled factor)."""
import os, sys, dataclasses
from specdec.drafting import cast as C
prior = float(os.environ["PRIOR"])
orig = C.PlainDecodingCheck.__init__
def init(self, *a, **k):
    k.setdefault("prior_tokens", prior); orig(self, *a, **k)
C.PlainDecodingCheck.__init__ = init
from specdec.cli import main
sys.exit(main(sys.argv[1:]))
