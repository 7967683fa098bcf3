"""The mesh axes' names, in one place: every collective names its axis from here.

    dp  data parallel: each device a share of the batch's rows (ZeRO shards state over it)
    pp  pipeline parallel: each device a stage, a contiguous share of the layers
    cp  context parallel: each device a share of every row's tokens (ring attention)
    tp  tensor parallel: each device a share of every layer's heads and MLP width
    ep  expert parallel: each device a share of every MoE layer's experts, and (like dp)
        a share of the batch's rows; tokens reach their experts by all-to-all

The mesh always has all five, in the order (dp, ep, pp, cp, tp) (`runtime.mesh.MESH_AXES`);
a size-1 axis costs nothing.
"""
DP, EP, PP, CP, TP = "dp", "ep", "pp", "cp", "tp"
