"""What XLA does with a program: collectives and bytes in the HLO (`hlo`), memory and time,
and the hardware's peak FLOP/s (`hardware`)."""
