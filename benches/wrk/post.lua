wrk.method = "POST"
wrk.body   = '{"inputs":"hello","parameters":{"max_new_tokens":16}}'
wrk.headers["Content-Type"] = "application/json"
