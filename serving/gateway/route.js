// The gateway's look into a request's body (nginx's njs; loaded by the nginx.conf that serving/gateway/nginx.py
// renders). nginx alone cannot read a JSON body, so this does the two things that need it:
//   check(r)  the content handler of /v1/: a body that is not a JSON object is a 400; max_tokens (or
//             max_completion_tokens) over $max_new_tokens is a 400; a model the gateway does not route is a 404;
//             else the request goes on to @route, which proxies it to $route_pool (nginx.conf's map of $body_model)
//   model(r)  $body_model: the body's "model" (js_set: read once the body is in memory, that is after check)
//   usage(r)  the body filter of @route: a stream's usage, its comment line ": usage <prompt> <completion>"
//             (serving/protocol.py USAGE_COMMENT), into $stream_usage for the access log; the bytes pass unchanged
// Errors are OpenAI's shape, as the replicas' own. Written for njs 0.7 (Debian 12's): ES5 and a few ES6 forms.

function parsed(r) {
    try {
        var text = r.requestText;  // (undefined, or an exception, before the body is read: no model yet)
        if (!text) {
            return {};
        }
        var body = JSON.parse(text);
        return (body !== null && typeof body === "object" && !Array.isArray(body)) ? body : null;
    } catch (e) {
        return null;
    }
}

function refuse(r, status, message, param, code) {
    r.headersOut["Content-Type"] = "application/json";
    r.return(status, JSON.stringify({error: {message: message, type: "invalid_request_error", param: param,
                                             code: code}}));
}

function check(r) {
    if (r.method !== "POST") {
        if (!r.variables.route_pool) {
            refuse(r, 404, "no route " + r.method + " " + r.uri + " at the gateway", null, "not_found");
            return;
        }
        r.internalRedirect("@route");
        return;
    }
    var body = parsed(r);
    if (body === null) {
        refuse(r, 400, "the request body is not a JSON object", null, "bad_request");
        return;
    }
    var limit = Number(r.variables.max_new_tokens);
    var names = ["max_tokens", "max_completion_tokens"];
    for (var i = 0; i < names.length; i++) {
        var asked = body[names[i]];
        if (typeof asked === "number" && asked > limit) {
            refuse(r, 400, names[i] + " " + asked + " is over the gateway's limit of " + limit, names[i],
                   "bad_request");
            return;
        }
    }
    if (!r.variables.route_pool) {
        refuse(r, 404, "the gateway routes no model named " + JSON.stringify(String(body.model)) + "; it routes: " +
               r.variables.routed_models, "model", "model_not_found");
        return;
    }
    r.internalRedirect("@route");
}

function model(r) {
    var body = parsed(r);
    return (body && typeof body.model === "string") ? body.model : "";
}

var tail = "";  // (the end of the previous chunk: a line may span two; each request has its own njs VM)

function usage(r, data, flags) {
    var text = tail + data.toString();
    var found = /(^|\n): usage (\d+) (\d+)\n/.exec(text);
    if (found) {
        r.variables.stream_usage = found[2] + " " + found[3];
    }
    tail = text.slice(-48);
    r.sendBuffer(data, flags);
}

export default {check, model, usage};
