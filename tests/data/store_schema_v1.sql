CREATE TABLE IF NOT EXISTS schema_info (version INTEGER);

CREATE TABLE IF NOT EXISTS problems (
    campaign VARCHAR, iteration INTEGER, problem_id VARCHAR,
    env VARCHAR, split VARCHAR, prompt VARCHAR, payload JSON, messages JSON,
    created_at TIMESTAMPTZ,
    refill_round INTEGER,  -- 0 (or NULL): curated; k >= 1: drawn by dynamic sampling's k-th refill round (score)
    PRIMARY KEY (campaign, iteration, problem_id)
);

CREATE TABLE IF NOT EXISTS rollouts (
    campaign VARCHAR, iteration INTEGER, problem_id VARCHAR, sample INTEGER,
    env VARCHAR, policy_version INTEGER,
    prompt_text VARCHAR, completion VARCHAR,
    prompt_ids INTEGER[], completion_ids INTEGER[], logprobs FLOAT[],
    loss_mask UTINYINT[], turns JSON, finish_reason VARCHAR,
    prompt_tokens INTEGER, completion_tokens INTEGER, tool_calls INTEGER, tool_errors INTEGER, rework INTEGER,
    generated_at TIMESTAMPTZ,
    reward DOUBLE, passed BOOLEAN, reason VARCHAR, detail JSON, scored_at TIMESTAMPTZ,
    temperature DOUBLE, top_p DOUBLE,  -- what the behaviour log-probs were sampled with (replays use them)
    refill_round INTEGER,  -- 0 (or NULL): sampled by the rollout stage; k >= 1: dynamic sampling's k-th refill round
    PRIMARY KEY (campaign, iteration, problem_id, sample)
);

CREATE TABLE IF NOT EXISTS evals (
    campaign VARCHAR, iteration INTEGER, model_version INTEGER, role VARCHAR,
    problem_id VARCHAR, sample INTEGER, env VARCHAR,
    completion VARCHAR, completion_tokens INTEGER, turns JSON, tool_calls INTEGER, tool_errors INTEGER,
    rework INTEGER, reward DOUBLE, passed BOOLEAN, reason VARCHAR, reused_from INTEGER,
    created_at TIMESTAMPTZ,
    split VARCHAR,     -- gate (what promotion compares), test or transfer (sealed: never seen by the gate)
    gen_key VARCHAR,   -- hash of how the answer was generated: rows are reused only when it matches
    PRIMARY KEY (campaign, iteration, model_version, problem_id, sample)
);

CREATE TABLE IF NOT EXISTS promotions (
    campaign VARCHAR, iteration INTEGER,
    challenger_version INTEGER, champion_version INTEGER, promoted BOOLEAN,
    challenger_pass1 DOUBLE, champion_pass1 DOUBLE, p_better DOUBLE, gain_low DOUBLE, gain_high DOUBLE,
    per_env JSON, reason VARCHAR, reset_trainee BOOLEAN, decided_at TIMESTAMPTZ,
    PRIMARY KEY (campaign, iteration)
);

CREATE TABLE IF NOT EXISTS stage_runs (
    campaign VARCHAR, iteration INTEGER, stage VARCHAR, status VARCHAR,
    started_at TIMESTAMPTZ, finished_at TIMESTAMPTZ, wall_s DOUBLE, cpu_s DOUBLE,
    metrics JSON, flow_run_id VARCHAR, error VARCHAR,
    PRIMARY KEY (campaign, iteration, stage)
);

CREATE TABLE IF NOT EXISTS model_versions (
    campaign VARCHAR, version INTEGER, iteration INTEGER, kind VARCHAR,
    path VARCHAR, parent_version INTEGER, created_at TIMESTAMPTZ,
    PRIMARY KEY (campaign, version)
);

CREATE TABLE IF NOT EXISTS campaigns (
    campaign VARCHAR PRIMARY KEY, config JSON, updated_at TIMESTAMPTZ
);

CREATE TABLE IF NOT EXISTS campaign_state (
    campaign VARCHAR PRIMARY KEY, trainee_version INTEGER, updated_at TIMESTAMPTZ
);

CREATE TABLE IF NOT EXISTS env_validations (
    env VARCHAR, options JSON, ok BOOLEAN, checked INTEGER, failures JSON, validated_at TIMESTAMPTZ,
    PRIMARY KEY (env, options)
);

CREATE TABLE IF NOT EXISTS rollbacks (
    campaign VARCHAR, rolled_back_at TIMESTAMPTZ, from_version INTEGER, to_version INTEGER, reason VARCHAR,
    PRIMARY KEY (campaign, rolled_back_at)
);

CREATE TABLE IF NOT EXISTS mix (    -- the adaptive environment mix: each environment's share, per iteration, and why
    campaign VARCHAR, iteration INTEGER, env VARCHAR, weight DOUBLE, share DOUBLE, problems INTEGER,
    groups INTEGER, pass_rate DOUBLE, informative_share DOUBLE, learnability DOUBLE, reason VARCHAR,
    created_at TIMESTAMPTZ,
    PRIMARY KEY (campaign, iteration, env)
);

CREATE TABLE IF NOT EXISTS sft_examples (    -- the rollouts the optional sft stage trained on (sft.select)
    campaign VARCHAR, iteration INTEGER, source_iteration INTEGER, problem_id VARCHAR, sample INTEGER, env VARCHAR,
    pair INTEGER, role VARCHAR,  -- sft.method = 'dpo': the pair's number and 'chosen' or 'rejected' (sft: NULL)
    PRIMARY KEY (campaign, iteration, source_iteration, problem_id, sample)
);

CREATE TABLE IF NOT EXISTS sandbox_runs (
    run_id VARCHAR PRIMARY KEY, campaign VARCHAR, iteration INTEGER, purpose VARCHAR,
    code_sha256 VARCHAR, limits JSON, exit_code INTEGER, signal INTEGER,
    wall_s DOUBLE, cpu_s DOUBLE, peak_rss_kb BIGINT, stdout_bytes BIGINT, stderr_bytes BIGINT,
    limit_hit VARCHAR, started_at TIMESTAMPTZ
);

CREATE TABLE IF NOT EXISTS approvals (    -- a person's answer to a promotion the gate passed (promotion.approval)
    campaign VARCHAR, iteration INTEGER, challenger_version INTEGER, champion_version INTEGER,
    decision VARCHAR,  -- pending, approved, rejected or timeout (no answer within promotion.approval_timeout_s)
    reviewer VARCHAR, reason VARCHAR, requested_at TIMESTAMPTZ, decided_at TIMESTAMPTZ, waited_s DOUBLE,
    flow_run_id VARCHAR, evidence VARCHAR,  -- the Markdown the reviewer was shown
    PRIMARY KEY (campaign, iteration)
);

-- the endpoint's requests (evertrain.serving), redacted before they are stored; written in batches. No key: a
-- trace id is a fresh random id, so a batch is a plain insert (no delete scan of the growing table per batch)
CREATE TABLE IF NOT EXISTS traces (
    trace_id VARCHAR, campaign VARCHAR, model_version INTEGER, model VARCHAR,
    env VARCHAR, problem_id VARCHAR, problem JSON,  -- the task, when the client named one (extra body 'evertrain')
    request JSON, response JSON, tool_calls JSON, tools VARCHAR,  -- tools: the tool names used, comma-separated
    status VARCHAR, http_status INTEGER, error VARCHAR, finish_reason VARCHAR,
    latency_ms DOUBLE, prompt_tokens INTEGER, cached_tokens INTEGER, completion_tokens INTEGER, cost_usd DOUBLE,
    created_at TIMESTAMPTZ
);

-- outcomes of traces: the environment's verifier (when the client named the task) or the client (POST /feedback)
CREATE TABLE IF NOT EXISTS trace_feedback (
    trace_id VARCHAR, campaign VARCHAR, source VARCHAR, passed BOOLEAN, reward DOUBLE, detail JSON,
    created_at TIMESTAMPTZ
);

CREATE TABLE IF NOT EXISTS curriculum (    -- each environment's difficulty level per iteration, and why it moved
    campaign VARCHAR, iteration INTEGER, env VARCHAR, level INTEGER, max_level INTEGER, previous_level INTEGER,
    groups INTEGER, pass_rate DOUBLE, action VARCHAR, reason VARCHAR, created_at TIMESTAMPTZ,
    PRIMARY KEY (campaign, iteration, env)
);

CREATE TABLE IF NOT EXISTS broad_sealed (    -- the broad sealed set: drawn once per campaign across all levels
    campaign VARCHAR, problem_id VARCHAR, env VARCHAR, level INTEGER, source VARCHAR,
    prompt VARCHAR, payload JSON, created_at TIMESTAMPTZ,
    PRIMARY KEY (campaign, problem_id)
);
