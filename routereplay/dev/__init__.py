"""Development and tests only: the embedded tiny models, throwaway certificates, synthetic
records and the launcher that starts the services as local processes."""
