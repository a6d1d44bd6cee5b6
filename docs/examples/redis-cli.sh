#!/usr/bin/env bash
# inflight from the shell: queue a job with redis-cli, then follow its reply stream to
# the final event, printing the text as it arrives. Needs redis-cli 7+ and jq.
#
#   docs/examples/redis-cli.sh "The capital of France is"
#   docs/examples/redis-cli.sh "Name a city and its country as JSON." "" \
#     '{"type":"object","properties":{"city":{"type":"string"},"country":{"type":"string"}},"required":["city","country"]}'
#
# The third argument, a JSON schema, makes it a constrained job: the answer is JSON
# valid under the schema (unless it ends for `length`).
#
# REDIS_URL defaults to the embedded server `make run` starts; INFLIGHT_REQUESTS names
# the request stream (default inflight:requests). A server that cannot be reached or
# goes away, or no reply for INFLIGHT_TIMEOUT_S seconds (default 60: no worker is
# running), ends it with one line on stderr and exit status 1.
set -euo pipefail
url=${REDIS_URL:-redis://127.0.0.1:6399}
requests=${INFLIGHT_REQUESTS:-inflight:requests}
timeout_s=${INFLIGHT_TIMEOUT_S:-60}
prompt=${1:-The capital of France is}
id=${2:-shell-$(date +%s%N)}
schema=${3:-}
errors=$(mktemp)
trap 'rm -f "$errors"' EXIT
# redis-cli, whose failure ends the script with one line that names the server
# (without its password).
rcli() {
  redis-cli --no-auth-warning -u "$url" -2 --json "$@" 2>"$errors" && return
  echo "Redis at ${url#*@} is unavailable: $(tail -n 1 "$errors")" >&2
  exit 1
}

if [ -n "$schema" ]; then
  rcli XADD "$requests" '*' id "$id" prompt "$prompt" max_tokens 64 json_schema "$schema" >/dev/null
else
  rcli XADD "$requests" '*' id "$id" prompt "$prompt" max_tokens 16 >/dev/null
fi
reply="inflight:out:{$id}"  # the default reply_to; {…} is a Redis Cluster hash tag
last=0
heard=$SECONDS
while :; do
  if ((SECONDS - heard >= timeout_s)); then
    echo "no reply to $id within $timeout_s s: no worker is serving $requests, or it stopped (the job stays queued)" >&2
    exit 1
  fi
  batch=$(rcli XREAD BLOCK 1000 STREAMS "$reply" "$last")
  [ "$batch" = "null" ] && continue  # nothing new within 1 s
  heard=$SECONDS
  # One JSON object per reply entry: its fields, plus its id.
  while read -r entry; do
    last=$(jq -r .id <<<"$entry")
    case $(jq -r .type <<<"$entry") in
      token) jq -j .text <<<"$entry" ;;
      done) jq -r '"\(.text)\n(\(.finish_reason): \(.completion_tokens) tokens)"' <<<"$entry"; exit 0 ;;
      error) jq -r '"error \(.code): \(.message)"' <<<"$entry" >&2; exit 1 ;;
    esac
  done < <(jq -c '.[0][1][] | . as [$id, $fields]
                  | [range(0; $fields | length; 2) | {key: $fields[.], value: $fields[. + 1]}]
                  | from_entries + {id: $id}' <<<"$batch")
done
