"""rljax: policy-gradient RL for language models as five independent axes."""
