"""The pipeline trainer's split of a model into stages: which modules each stage holds
(``split``), the parts of known model families (``presets``), the plan of a job (``plan``), and
how a stage builds only its own part (``stage_init``). The strategy that runs the stages is
forge/train/strategies/pipeline.py."""
