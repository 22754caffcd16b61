"""The training set-ups the CLI, the benchmarks and the tests share: litgpt models with their loss (``litgpt_models``),
where a step computes its loss (``loss_placement``), process groups, devices and executors (``runtime``; attention
on torch's cuDNN kernels, ``cudnn_attention``), and the FSDP modes compared (``modes``)."""
