"""What runs a compiled plan on every rank: the ParallelModule, process groups, the gradient reducer,
ZeRO, the pipeline executor and the optimizer. The device code the generated programs call lives in
`nnscaler_plugins.kernels`; the programs themselves come from the compile stage."""
