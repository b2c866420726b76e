"""GPU kernels (Triton). Imported only when the Triton attention backend is selected; every kernel
has a torch reference in common/model/attention.py and is tested on CPU under TRITON_INTERPRET=1."""
