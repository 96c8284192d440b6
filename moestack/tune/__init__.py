"""Measuring this machine for the planner (`moestack tune`, `moestack tune-comm`): everything that builds or runs a
model or an op to time it. Above train/ in the layer order; the pure cost model it feeds is moestack/planner/."""
