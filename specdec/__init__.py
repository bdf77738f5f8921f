"""specdec: speculative decoding for Hugging Face causal language models."""

from specdec.cpu_blas import configure_mkl

configure_mkl()  # before anything multiplies on the CPU: MKL's fast small-product path on non-Intel x86 CPUs (specdec/cpu_blas.py)

__version__ = "0.1.0"
