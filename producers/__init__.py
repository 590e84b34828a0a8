"""Task producers: the SDK that publishes rollout jobs, and the trajectory reader."""
