"""The CPU backend of a stage's forwards (``device.kernels=cpu``): the lean forward of transformers'
Llama (lean.py) on the project's kernels: float32 linears reading each weight once for 1..16 rows
and prefills on torch's GEMM in fixed tiles (flat_linear.py), low-bit copies (lowbit.py), each
row's attention alone (attention.py); C++ in kernels/, compiled once per machine and ISA. Chosen
by models/loader.py; stage/ and speculative/ never import it."""
