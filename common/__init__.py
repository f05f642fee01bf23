"""Engine pieces shared by the prefill and decode services (config, model, pools, sampling)."""
