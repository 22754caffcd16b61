"""The training set-ups the CLI, the benchmarks and the tests share: litgpt models with their loss (``models``),
process groups, devices and executors (``runtime``), and the FSDP modes compared (``modes``)."""
