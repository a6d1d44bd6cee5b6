#!/usr/bin/env bash
# inflight from the shell: queue a job with redis-cli, then follow its reply stream to
# the final event, printing the text as it arrives. Needs redis-cli 7+ and jq.
#
#   docs/examples/redis-cli.sh "The capital of France is"
#
# REDIS_URL defaults to the embedded server `make run` starts; INFLIGHT_REQUESTS names
# the request stream (default inflight:requests).
set -euo pipefail
url=${REDIS_URL:-redis://127.0.0.1:6399}
requests=${INFLIGHT_REQUESTS:-inflight:requests}
prompt=${1:-The capital of France is}
id=${2:-shell-$(date +%s%N)}
rcli() { redis-cli -u "$url" -2 --json "$@"; }

rcli XADD "$requests" '*' id "$id" prompt "$prompt" max_tokens 16 >/dev/null
reply="inflight:out:{$id}"  # the default reply_to; {…} is a Redis Cluster hash tag
last=0
while :; do
  batch=$(rcli XREAD BLOCK 5000 STREAMS "$reply" "$last")
  [ "$batch" = "null" ] && continue  # nothing new within 5 s
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
