import json, sys, glob, os
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:
        d = json.load(open(f))
    except Exception as e:
        print(os.path.basename(f), "unreadable", e); continue
    for name, c in d.get("configs", {}).items():
        r = d.get("ratios", {}).get(name, {})
        tp = c.get("traffic_parts_p90_ms", {})
        print(os.path.basename(f), name, "tok/s", c.get("decode_tokens_per_s"), "held", c.get("sessions_held"),
              "fail", c.get("oom_or_failures"), "vs_bound", r.get("throughput_vs_bound"),
              "L2", c.get("resume_ms_p50_l2"), "/", c.get("ceiling_ms_p50_l2"), r.get("resume_l2_vs_ceiling_p50"),
              "L3", c.get("resume_ms_p50_l3"), "/", c.get("ceiling_ms_p50_l3"), r.get("resume_l3_vs_ceiling_p50"),
              "res", c.get("resumes_by_source"), "p50q", c.get("step_ms_p50_quiet"), "p50t", c.get("step_ms_p50_traffic"),
              "tp90", {k: tp[k] for k in list(tp)[:6]})
