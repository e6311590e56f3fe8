local NS = "llmgw.response"

function envoy_on_request(handle)
  local headers = handle:headers()
  if headers:get("x-llmgw-route") == nil then return end  -- not forwarded by extproc
  local meta = handle:streamInfo():dynamicMetadata()
  meta:set(NS, "on", true)
  if headers:get("x-llmgw-strip-usage") ~= nil then
    headers:remove("x-llmgw-strip-usage")  -- never reaches the pod
    meta:set(NS, "strip", true)
  end
  if headers:get("x-llmgw-cache") == "miss" then meta:set(NS, "keep", true) end
end

-- The response body of a cache miss, kept whole (up to KEEP_LIMIT) for the response cache.
local KEEP_LIMIT = 1048576
local function keeper()
  local parts, size = {}, 0
  return function(raw)
    if parts == nil then return end
    size = size + #raw
    if size > KEEP_LIMIT then parts = nil else parts[#parts + 1] = raw end
  end, function(meta)
    if parts == nil then meta:set(NS, "body_cut", true) else meta:set(NS, "body", table.concat(parts)) end
  end
end

-- Occurrences of `key` (plain text) in `text` that start a non-empty JSON string.
local function count(text, key)
  local n, at = 0, 1
  while true do
    local _, stop = text:find(key, at, true)
    if stop == nil then return n end
    if text:byte(stop + 1) ~= 34 then n = n + 1 end
    at = stop + 1
  end
end

-- Where a usage object starts in `text` (compact or with one space), or nil.
local function usage_at(text)
  local at = text:find('"usage":', 1, true)
  if at == nil then return nil end
  return text:find('"usage":{', at, true) or text:find('"usage": {', at, true)
end

-- The usage object starting at `at` in `text`: true once read (false: cut short).
local function read_usage(meta, text, at)
  local body = text:sub(at, at + 1023)
  local input = body:match('"prompt_tokens":%s*(%d+)')
  if input == nil or body:find("}", 1, true) == nil then return false end
  meta:set(NS, "in", tonumber(input))
  meta:set(NS, "out", tonumber(body:match('"completion_tokens":%s*(%d+)') or "0"))
  local cached = body:match('"cached_tokens":%s*(%d+)')
  if cached ~= nil then meta:set(NS, "cached", tonumber(cached)) end
  return true
end

-- The complete SSE events of `text` without the usage event (empty choices and a usage object;
-- the "usage":null of other chunks stays), and the incomplete rest.
local function split(text)
  local cut = text:match("^.*\n\r?\n()")
  if cut == nil then
    if #text < 65536 then return "", text end
    cut = #text + 1  -- no event boundary in 64 KiB: not SSE as expected, pass on
  end
  local events, rest = text:sub(1, cut - 1), text:sub(cut)
  if not usage_at(events) then return events, rest end
  local kept, from = {}, 1
  while from < cut do
    local _, stop = events:find("\n\r?\n", from)
    stop = stop or #events
    local event = events:sub(from, stop)
    if not (event:find('"choices":%s*%[%s*%]') and usage_at(event)) then
      kept[#kept + 1] = event
    end
    from = stop + 1
  end
  return table.concat(kept), rest
end

-- The metadata wrapper dies when the script waits for a chunk: it is fetched again after.
local function stream(handle, strip, keep)
  handle:streamInfo():dynamicMetadata():set(NS, "sse", true)
  local add, done = nil, nil
  if keep then add, done = keeper() end
  local events, pending, tail = 0, nil, nil  -- tail: the end of a chunk cut mid-event
  local held, last, last_out = "", nil, ""
  for chunk in handle:bodyChunks() do
    local raw = chunk:getBytes(0, chunk:length())
    if add ~= nil then add(raw) end
    local n = count(raw, 'content":"')  -- content and reasoning_content
    if n == 0 then n = count(raw, '"text":"') end
    local meta = nil
    if n > 0 then
      if events == 0 then
        meta = handle:streamInfo():dynamicMetadata()
        meta:set(NS, "first_ms", handle:timestamp())
      end
      events = events + n
      -- Written as it grows (~1 us): a stream cut by the client still reports what it saw.
      meta = meta or handle:streamInfo():dynamicMetadata()
      meta:set(NS, "events", events)
    end
    local at = nil
    if pending ~= nil then
      pending = pending .. raw
      meta = meta or handle:streamInfo():dynamicMetadata()
      if read_usage(meta, pending, 1) or #pending > 4096 then pending = nil end
    else
      at = usage_at(raw)
      if at == nil and tail ~= nil then  -- the key may be cut between two chunks
        local seam = tail .. raw:sub(1, 16)
        local in_seam = usage_at(seam)
        if in_seam ~= nil then
          meta = meta or handle:streamInfo():dynamicMetadata()
          pending = seam:sub(in_seam) .. raw:sub(17)
          if read_usage(meta, pending, 1) then pending = nil end
        end
      elseif at ~= nil then
        meta = meta or handle:streamInfo():dynamicMetadata()
        if not read_usage(meta, raw, at) then pending = raw:sub(at) end
      end
      tail = nil
      if raw:byte(-1) ~= 10 then tail = raw:sub(-16) end
    end
    if strip then
      if held == "" and at == nil and pending == nil and raw:byte(-1) == 10 and raw:byte(-2) == 10 then
        last, last_out = chunk, raw  -- whole events, no usage: passed as is
      else
        local out
        out, held = split(held .. raw)
        if out ~= raw then chunk:setBytes(out) end  -- interned strings: an O(1) compare
        last, last_out = chunk, out
      end
    end
  end
  if held ~= "" and last ~= nil then last:setBytes(last_out .. held) end
  if done ~= nil then done(handle:streamInfo():dynamicMetadata()) end
end

local function whole(handle, keep)
  -- A JSON body ends with its usage object: only the tail of each chunk is read.
  local tail = ""
  local add, done = nil, nil
  if keep then add, done = keeper() end
  for chunk in handle:bodyChunks() do
    local length = chunk:length()
    if add ~= nil then add(chunk:getBytes(0, length)) end
    local from = length > 4096 and length - 4096 or 0
    tail = tail .. chunk:getBytes(from, length - from)
    if #tail > 8192 then tail = tail:sub(-4096) end
  end
  local at, found = 1, nil
  while true do
    local next_at = tail:find('"usage":%s*{', at)
    if next_at == nil then break end
    found, at = next_at, next_at + 1
  end
  if found ~= nil then read_usage(handle:streamInfo():dynamicMetadata(), tail, found) end
  if done ~= nil then done(handle:streamInfo():dynamicMetadata()) end
end

function envoy_on_response(handle)
  local mark = handle:streamInfo():dynamicMetadata():get(NS)
  if mark == nil or not mark.on then return end
  local content_type = handle:headers():get("content-type") or ""
  if content_type:find("text/event-stream", 1, true) == 1 then
    stream(handle, mark.strip, mark.keep)
  else
    whole(handle, mark.keep)
  end
end
