"""The mesh axes' names, in one place: every collective names its axis from here.

    dp  data parallel: each device a share of the batch's rows (ZeRO shards state over it)
    pp  pipeline parallel: each device a stage, a contiguous share of the layers
    cp  context parallel: each device a share of every row's tokens (ring attention)
    tp  tensor parallel: each device a share of every layer's heads and MLP width

The mesh always has all four, in the order (dp, pp, cp, tp) (`runtime.mesh.MESH_AXES`);
a size-1 axis costs nothing.
"""
DP, PP, CP, TP = "dp", "pp", "cp", "tp"
