"""What the analysis prints and writes: the paper's tables and plots, a plan's text and job, the
published runs."""
