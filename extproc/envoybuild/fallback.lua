-- Per attempt (an upstream filter runs once for each): the attempt that goes to the
-- fallback model's pod (x-llmgw-fallback: "host model", set by extproc) gets that
-- model in the body. The request headers are shared by every attempt: the original
-- content-length is kept in dynamic metadata and put back first.
local NS = "llmgw.fallback"

-- Where the top-level "model" string's value starts and ends (its quotes), or nil.
local function model_at(s)
  local i, depth = 1, 0
  while true do
    local p = s:find('[{}%[%]"]', i)
    if p == nil then return nil end
    local c = s:byte(p)
    if c == 34 then
      local q = p + 1
      while true do
        local e = s:find('["\\]', q)
        if e == nil then return nil end
        if s:byte(e) == 92 then q = e + 2 else q = e; break end
      end
      if depth == 1 and q - p == 6 and s:sub(p, q) == '"model"' then
        local _, open = s:find('^%s*:%s*"', q + 1)
        if open ~= nil then
          local r = open + 1
          while true do
            local e = s:find('["\\]', r)
            if e == nil then return nil end
            if s:byte(e) == 92 then r = e + 2 else return open, e end
          end
        end
      end
      i = q + 1
    elseif c == 123 or c == 91 then depth = depth + 1; i = p + 1
    else depth = depth - 1; i = p + 1 end
  end
end

function envoy_on_request(handle)
  local headers = handle:headers()
  local host = headers:get("x-llmgw-upstream-host")
  headers:remove("x-llmgw-upstream-host")
  local fallback = headers:get("x-llmgw-fallback")
  if fallback == nil then return end
  local meta = handle:streamInfo():dynamicMetadata()
  local saved = meta:get(NS)
  if saved == nil then
    meta:set(NS, "cl", headers:get("content-length") or "")
  elseif saved.cl ~= nil then
    if saved.cl == "" then headers:remove("content-length") else headers:replace("content-length", saved.cl) end
  end
  local target_host, model = fallback:match("^(%S+) (%S+)$")
  if model == nil or host ~= target_host then return end  -- the body streams through untouched
  headers:remove("x-llmgw-fallback")
  local body = handle:body()
  if body == nil then return end
  local raw = body:getBytes(0, body:length())
  local from, to = model_at(raw)
  if from == nil then return end
  body:setBytes(raw:sub(1, from) .. model .. raw:sub(to))  -- content-length follows
end
