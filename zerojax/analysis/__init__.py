"""Analysis: the ZeRO paper's estimator, memory and collectives measured from compiled steps
(`accounting`, `hlo`), and the planner that searches configurations (`planning`)."""
