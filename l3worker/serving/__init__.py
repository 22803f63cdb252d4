"""`l3worker serve`: the command line, the engine-core process and its wire, API server processes.
May import everything below it (engine/, worker/, distributed/, structured/); openai/ holds the HTTP layer."""
