"""Analysis: the ZeRO paper's estimator, memory and collectives measured from compiled steps
(`accounting`, `hlo`), model FLOPs, device peaks and MFU (`flops`), and the planner that
searches configurations (`planning`)."""
