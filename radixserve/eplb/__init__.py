"""Expert-parallel load balancing (SGLang's srt/eplb): choose where the experts' physical copies
live from a recorded expert distribution (eplb_algorithms.py), describe that placement
(expert_location.py) and apply it to a running model (eplb_manager.py)."""
