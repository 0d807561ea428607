"""The CPU kernels and their plug-in adapters for the engine (models/engine.py): float32 linears
reading each weight once for 1..16 rows and prefills on torch's GEMM in fixed tiles
(flat_linear.py), low-bit copies (lowbit.py), each row's attention alone (attention.py), and
which of them a CPU stage runs (plugins.py); C++ in kernels/, compiled once per machine and ISA.
Chosen by models/loader.py; stage/ and speculative/ never import it."""
