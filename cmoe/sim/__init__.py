"""The SimPy model of the PCIe link, the expert pool, the CUDA streams and the CPU worker."""
