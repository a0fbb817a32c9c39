"""The KV data layer (extras ``torch``, ``cuda``): block storage and paged attention.

``storage`` holds the K/V pools (device and pinned host) and runs block copies;
``attention`` reads them through block tables (reference, torch and CUDA paths);
``cuda_kernels`` launches the CuPy raw kernels of ``prefixkv.kernels``. Only this
package loads ``kernels/``; the core never imports it.
"""
