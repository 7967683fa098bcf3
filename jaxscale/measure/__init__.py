"""What XLA does with a program: collectives and bytes in the HLO (`hlo`), per-device memory
(`memory`), compile and step time (`timing`), how far two trees of arrays differ
(`compare_trees`), and the hardware's peak FLOP/s (`hardware`)."""
