"""The engines as the service knows them: their rows (the registry), their configuration from
the environment, a worker's claim on its name, commands to one worker, the deployment's id."""
