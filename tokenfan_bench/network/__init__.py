"""Where the bench's bytes travel: the userspace shaping proxy and its network profiles, each arm's route,
nginx in front of the gateway."""
