"""The offload tiers below the device: host memory and NVMe (ZeRO-Offload, ZeRO-Infinity)."""
